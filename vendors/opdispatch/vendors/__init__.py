"""Built-in vendor plugins. Each subpackage is a plugin published through the ``opdispatch.plugins`` entry
point group in opdispatch's own pyproject, exactly like a third-party plugin."""
