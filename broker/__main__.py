"""``python -m zchannel.broker``: the broker child started by ``Channel.create``."""

import sys

from zchannel.broker.server.entry import main_from_stdin

if __name__ == "__main__":
    sys.exit(main_from_stdin())
