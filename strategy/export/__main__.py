"""``python -m strategy.export CKPT_DIR OUT_DIR ...``: see ``strategy.export.offline``."""

from strategy.export.offline import main

main()
