"""What travels: the wire records, the item codec, registered classes and the argument checks both ends run."""
