"""Model files as both sides read them: safetensors and GGUF headers, builtin recipes, cache
paths. Pure: imports neither mlx nor anyio, nor the runner or supervisor packages."""
