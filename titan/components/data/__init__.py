"""Where tokens come from: datasets, packing, data order, tokenizer, dataloaders."""
