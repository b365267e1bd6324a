"""Importing this module imports TensorFlow once, with its C++ start-up notices filtered
(tf_env.import_tensorflow); the backends' TF modules import it before `tensorflow`."""

from . import tf_env

tensorflow = tf_env.import_tensorflow()
