"""The VideoJob controller: kopf handlers (``handlers``) over plain parts
(``lifecycle``, ``admission``, ``groups``, ``outcome``, ``status``, ``kube``, ``operator``)."""
