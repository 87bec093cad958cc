"""Data: which samples each rank sees, and the batches it gets.

- ``datasets``: the built-in datasets and user factories; ``mnist``: MNIST's IDX files;
  ``tokenfile``: windows of nanoGPT-style token files (``train.bin``, ``val.bin``), memory-mapped;
  ``info``: what a model needs to know about a dataset.
- ``sampler``: ``StepSampler``, each rank's samples per micro-batch, on the global batch;
  ``loader``: batches for one rank from that sampler; ``batching``: the global-batch rule;
  ``streaming``: the same for a stream (an ``IterableDataset``), split as it is read; ``handed``:
  what a ``DataLoader`` handed to ``strategy.loader`` gives it (dataset, global batch, collation).
- ``batch``: the one rule for what in a sample is input and target, and how the model is called.
- ``settings``: ``DataSettings``, the config's model-and-data section, and its checks.
"""
