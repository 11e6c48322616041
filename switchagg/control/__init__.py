"""The control plane of the P4 target: building the program and driving BMv2 over P4Runtime."""
