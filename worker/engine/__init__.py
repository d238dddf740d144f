"""The engine: continuous batching of many adapters over one base model (scheduler, KV blocks, sequences, model runner, CUDA graphs, async steps). Never imports the server."""
