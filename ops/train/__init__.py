"""Training the bundled model: corpus, tokenizer, target, DSpark drafter, evaluation (issue 11)."""
