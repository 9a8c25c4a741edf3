"""zchannel.cli: the ``zchannel`` command (click)."""
