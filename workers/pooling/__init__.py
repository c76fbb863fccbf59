"""Pooling models: how a model folder pools (config), pooling hidden states into embeddings (pooler), and the
runner of encoder-only models."""
