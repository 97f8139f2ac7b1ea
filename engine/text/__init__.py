"""Text in and out: the tokenizer, chat templates, prompts, and the detokenizer that releases
text only at whole characters."""
