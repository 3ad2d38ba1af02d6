"""Number crunching only: tensors in, tensors out. No tensor names, no format names.

Nothing in this package imports from the rest of the project.
"""
