"""The pipeline: raw forwards and steps resolved into calls and handed to every sink, off the model's thread."""
