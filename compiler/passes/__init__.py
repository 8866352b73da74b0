"""The graph transformations the stages run, shared between them: no stage imports another.

Conversion to the Edge dialect and decomposition (`edge_conversion`, `decomposition`,
`node_decompositions`), constant folding (`folding`), the partition search and its repairs
(`partitioning`, `cpu_rewrites`), and what a trace leaves in the shape environment (`tracing`).
"""
