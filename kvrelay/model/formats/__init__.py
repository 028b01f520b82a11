"""Model files as stored: the GGUF reader and loader, the Hugging Face directory loader."""
