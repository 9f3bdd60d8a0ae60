"""torch.distributed helpers: DTensor, ranks, the bounded agreement collective. Private."""
