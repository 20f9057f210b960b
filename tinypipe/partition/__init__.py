"""Partitioning solvers: packers (uniform, holistic, the Mobius MILP), GPU mappers, resolving a Policy for a machine."""
