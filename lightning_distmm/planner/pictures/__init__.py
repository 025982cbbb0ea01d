"""Pictures of a plan a person reads: the placement map, its links, and the timeline of one step."""
