import sys

from openrl_lab.kernel.parent import exit_with_parent

if sys.argv[1:2] != ["join"]:  # a control plane's child (a joined kernel is nobody's child): before torch loads
    exit_with_parent()

from openrl_lab.kernel.process import join_main, main

if sys.argv[1:2] == ["join"]:
    join_main(sys.argv[2:])
else:
    main()
