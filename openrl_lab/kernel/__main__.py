from openrl_lab.kernel.process import main

main()
