import sys

from openrl_lab.kernel.process import join_main, main

if sys.argv[1:2] == ["join"]:
    join_main(sys.argv[2:])
else:
    main()
