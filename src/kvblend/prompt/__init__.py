"""Prompts: segments, chat templates, the whole prompt's token ids and the prefill plan.

`segments` and `templates` describe a prompt; `tokens` and `splice` give exactly the token ids
the tokenizer gives the whole text (documents' memoised ids spliced in); `plan` says which
prompt token reads which cached row. Numpy and tokenizers only: no model runs here.
"""
