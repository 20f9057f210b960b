"""The host state of the layers a rank owns and the host optimizer that steps it (layouts, planes, kernel)."""
