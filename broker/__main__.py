"""``python -m zchannel.broker``: the broker child started by ``Channel.create``, which reads
its settings as msgpack on stdin; run by hand it says so (``zchannel broker`` is the command)."""

import sys

from zchannel.broker.server.entry import main_from_stdin

USAGE = ("python -m zchannel.broker is the broker process Channel.create starts: it reads its "
         "settings as msgpack on stdin, from its creator.\n"
         "To run a broker yourself: zchannel broker NAME [OPTIONS] (zchannel broker --help).")

if __name__ == "__main__":
    if len(sys.argv) > 1 or sys.stdin.isatty():
        print(USAGE, file=sys.stdout if sys.argv[1:] in (["-h"], ["--help"]) else sys.stderr)
        sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
    sys.exit(main_from_stdin())
