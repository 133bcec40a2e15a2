"""Reduction algorithms over process groups: flat, hierarchical, sparse, sealed."""
