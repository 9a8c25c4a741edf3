"""What the replicas of a distributed channel share: the cluster file, the binding table, key moves."""
