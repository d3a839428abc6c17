"""Where kernels run and how the control plane keeps track of them (torch-free): the fleet that places jobs on
them (`fleet`), where a control plane's own kernels come from (`launchers`: local child processes from `local`, or
Kubernetes Pods from `kubernetes`), kernels that join from other hosts (`join`) and the Pods' RBAC (`rbac`)."""
