"""Data: what each dataset is (`specs`) and which options a config may name (`options`),
both plain Python that the model and step tools read without TensorFlow; the tfds builders
and records (`records`), the training reader (`train`), the evaluation readers and host
batches (`eval`), the DeiT/timm augmentations (`augment`) and the offline digits builder
(`sklearn_digits`)."""
