import os
import sys

from openrl_lab.kernel.parent import exit_with_parent

# Before torch loads its OpenMP runtime: a thread that waits for work sleeps instead of spinning. On cores that
# other processes need (the control plane, the notebook, a neighbour's job) spinning threads take their time and
# stall each other: a sampler with 2 threads beside one busy core drew 2,100 tokens/s spinning, 6,200 passive
# (docs/benchmarks.md, issue 27).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if sys.argv[1:2] != ["join"]:  # a control plane's child (a joined kernel is nobody's child): before torch loads
    exit_with_parent()

from openrl_lab.kernel.process import join_main, main

if sys.argv[1:2] == ["join"]:
    join_main(sys.argv[2:])
else:
    main()
