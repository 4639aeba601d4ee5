"""Data preparation: ShareGPT loading and cleaning, chat rendering with loss masks, tokenised
dataset caching, and evaluation prompt sets."""
