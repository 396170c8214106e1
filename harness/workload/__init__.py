"""What is trained: model specs built from configs, synthetic packed data, the loss."""
