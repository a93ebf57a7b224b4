"""The configuration: the schema every Hydra config and recipe is checked against, its composition,
strict loading of recipe files, and a Hugging Face folder read as model keys."""
