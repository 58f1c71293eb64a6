"""minivllm's own model layers (chapter 06): linear layers with weight loaders, norms, RoPE."""
