import sys

from p2psync.cli.main import main

rc = main()
if len(sys.argv) > 2 and sys.argv[1] == "run" and "--node" in sys.argv[2:]:
    # a node process of `p2psync run` (the built-in job), done: its session has closed its sockets,
    # metrics and run files. Skip the interpreter's teardown of torch, numba and friends (0.3-1 s
    # per process, every process at once at the end of a run: issue 17's start-up item).
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
sys.exit(rc)
