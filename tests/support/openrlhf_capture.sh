# Sourced before one of OpenRLHF's example scripts (tests/test_openrlhf_scripts.py): the commands
# that would start its job write their arguments, NUL-separated, to $CAPTURE_OUT and end the shell;
# the cluster tools it calls on the way do nothing. An srun whose command runs OpenRLHF's job has
# that command run here (its `ray` found on PATH).
capture() { printf '%s\0' "$@" > "$CAPTURE_OUT"; exit 0; }
python3() { capture "$@"; }
python() { capture "$@"; }
deepspeed() { capture "$@"; }
ray() { capture "$@"; }
pip() { :; }
scontrol() { :; }
sleep() { :; }
srun() { local cmd="${*: -1}"; [[ $cmd == *openrlhf.cli.* ]] && eval "${cmd//\/root\/.local\/bin\/ray/ray}"; return 0; }
