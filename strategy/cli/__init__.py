"""The installed commands: one module per built-in trainer (``python -m strategy.cli.train_sft``,
``deepspeed --module strategy.cli.train_sft``, ``torchrun -m strategy.cli.train_sft``), and the
``strategy`` console command (``strategy sft --nproc 2 --config sft_zero2 ...``), which checks
the settings once and starts the ranks itself (``main``).

``trainers`` names each command's trainer; a command parses the shared configs and its own
trainer's only, and refuses another trainer's flag in one line naming who takes it.
``openrlhf_flags`` holds OpenRLHF's dotted flag spellings (``--ds.zero_stage``) and what each
becomes here.

May import: anything in ``strategy``; nothing imports from here.
"""
