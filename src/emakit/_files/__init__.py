"""Files: atomic writes and locks, safe reads, safetensors, DCP folders, the streamed full export. Private."""
