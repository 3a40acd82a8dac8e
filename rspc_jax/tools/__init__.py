"""Tools above training and evaluation: the CLIs' shared start-up and allocator choice,
the memory planner and the small-scale study."""
