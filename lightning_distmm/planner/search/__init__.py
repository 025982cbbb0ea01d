"""The search: a model, a cluster and a global batch in, the fastest plan the cost model prices and
its report out (partitioner, balancer, placement, colocated plans and baselines)."""
