"""One module per kind of cached state; each store knows its tensors and nothing about models."""
