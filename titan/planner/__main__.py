import signal
import sys

from titan.planner.cli import main

if __name__ == "__main__":
    # a short-lived tool piped into head & co ends as GNU tools do when the reader goes
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
