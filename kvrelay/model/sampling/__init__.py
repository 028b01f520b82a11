"""From logits to a token: the sampler, penalties and logits rules, prompt logprobs,
structured-output grammars."""
