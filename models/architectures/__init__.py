"""The architectures: dense tokenization, the layers, the offline user model and the online ranker, and the feature
transforms both train and serve with (attention kernels live beside this, in ``models.attention``)."""
