"""Data: dataset specs and tfds builders (`specs`), the training reader (`train`), the
evaluation readers and host batches (`eval`), the DeiT/timm augmentations (`augment`)
and the offline digits builder (`sklearn_digits`)."""
