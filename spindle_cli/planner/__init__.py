"""The pure planning core: graph contraction, curve fitting, allocation, waves, placement,
simulation and baselines. numpy, scipy and networkx only; never torch."""
