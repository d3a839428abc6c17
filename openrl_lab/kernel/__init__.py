"""The kernel: a long-lived process that holds jobs' model state and runs their primitives.

- `api`: the operations, typed (`KernelApi`); the wire table is derived from it. Start here to add one.
- `engine`: `Engine`, which implements them (training jobs, samplers, eviction and restore for time-slicing).
- `process`: the process itself: the gRPC servicer, start-up, `openrl-lab kernel` and `kernel join`.
- `client`: the control plane's side (`KernelClient.api()`), and the errors a call raises.
- `codec`: JSON plus raw array bytes on the wire (never pickle); `kernel.proto`: the gRPC messages.
- `join`: a kernel's side of joining a fleet from another host; `parent`: a child kernel exits with its parent.
"""
