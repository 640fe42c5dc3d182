"""Mutation catalogue: known bug classes applied as mutants to measure what the suites catch."""
