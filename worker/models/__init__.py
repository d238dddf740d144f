"""Model implementations (Llama family: Llama, Mistral, Qwen2)."""
