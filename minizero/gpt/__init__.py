"""The example the engine trains: minGPT's image GPT and its data (CIFAR-10 or synthetic images,
the k-means colour codebook, the per-rank loaders)."""
