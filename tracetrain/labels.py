"""Label values shared by the data pipeline, the losses and the parallel layouts."""

# Positions whose label is IGNORE_INDEX are not trained on (prompts, padding, document boundaries);
# PyTorch's cross_entropy skips them by default, and every loss here follows the same convention.
IGNORE_INDEX = -100
