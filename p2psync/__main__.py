import sys

from p2psync.cli.main import hard_exit, main

rc = main()
if len(sys.argv) > 2 and sys.argv[1] == "run" and "--node" in sys.argv[2:]:
    hard_exit(rc)  # a node process of `p2psync run` (the built-in job), done
sys.exit(rc)
