"""Where kernels run and how the control plane keeps track of them: local child processes (`local`), kernels
that join from other hosts (`join`), and the fleet that places jobs on them (`fleet`). Torch-free."""
