# Run by `cmake --install` (CMakeLists.txt): installs configs/jobs/*.toml into
# PREFIX/share/lorastream/configs/jobs/ with their output_dir lines commented out. In the source
# tree they point at the tree's runs/ folder; installed, the same relative path would point
# inside the prefix. `lorastream up` sets its own output folder; a copy run with `train` or
# `submit` names one of the user's.
set(dest "$ENV{DESTDIR}${CMAKE_INSTALL_PREFIX}/share/lorastream/configs/jobs")
file(MAKE_DIRECTORY "${dest}")
file(GLOB jobs "${LORASTREAM_JOBS_SRC}/*.toml")
foreach(job ${jobs})
  file(READ "${job}" text)
  string(REGEX REPLACE "\noutput_dir = \"[^\"\n]*\"[^\n]*"
    "\n# output_dir = \"...\"   # required in a copy you run: a folder of yours (`lorastream up` sets its own)"
    text "${text}")
  get_filename_component(name "${job}" NAME)
  message(STATUS "Installing: ${dest}/${name} (output_dir left to you)")
  file(WRITE "${dest}/${name}" "${text}")
endforeach()
